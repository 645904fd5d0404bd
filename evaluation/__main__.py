from evaluation.cli import main

main()
