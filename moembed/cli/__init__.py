"""The `moembed` command line: one module per job, each registering its subcommands on the app."""
