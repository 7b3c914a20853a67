from load_tests.cli import main

main()
