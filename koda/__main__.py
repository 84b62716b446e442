from koda.cli import main

main()
