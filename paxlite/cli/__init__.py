"""The command line: one module per `python -m paxlite` subcommand and the dispatcher that builds
their parser (`app`), the job runner paxlite.main and launch_trainer_main share (`job`: the job
directory, the compilation cache) and what they read a finished model from (`model_source`).
Every entry point reports its errors through paxlite.errors.report_errors."""
