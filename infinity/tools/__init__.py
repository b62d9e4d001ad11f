"""The command-line tools over the library: the `infinity` command (cli.py) and its subcommands train, tune,
plan (a package) and info. Nothing in the library imports from here."""
