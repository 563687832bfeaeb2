"""The driver: config parsing, the job plan, the run command and its launchers."""
