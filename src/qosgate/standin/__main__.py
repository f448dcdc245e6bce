from qosgate.standin.cli import main

main()
