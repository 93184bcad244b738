"""The `deepinfer` command: every subcommand, the cluster launcher and status."""
