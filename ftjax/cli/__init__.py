"""The `ftjax` command: `main` dispatches to one module per subcommand (train, check, data
prepare, bench, demo; launch, coordinator and simulate live with their packages)."""
