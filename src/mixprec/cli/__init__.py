"""The command line: argparse faces over the api, shared options, the terminal."""
