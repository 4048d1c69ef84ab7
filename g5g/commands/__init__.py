"""One module per subcommand; each exposes `run(args) -> exit code` and keeps its effects at the edge."""
