"""The runtime: load a program file and run its methods."""
