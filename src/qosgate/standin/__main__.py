from qosgate.standin.server import main

main()
