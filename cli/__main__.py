from koda_runtime.cli import main

main()
