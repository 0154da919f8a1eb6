from memfit.cli.app import main

main()
