"""The command line: one module per `python -m paxlite` subcommand, the job runner they share
(`job`: the job directory, the compilation cache, the one path that turns errors into exit statuses)
and what they read a finished model from (`model_source`)."""
