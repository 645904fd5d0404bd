from experiments.decompose.run import main

main()
