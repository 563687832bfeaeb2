"""Beam stages (read → tokenize → bucket → encode → write), the job driver and the CLI."""
