from nanoengine.cli import main

main()
