from experiments.attention.run import main

main()
