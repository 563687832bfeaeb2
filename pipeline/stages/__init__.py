"""The Beam stages, in the job's order: read, reuse, tokenize, batch (the packer), encode, write, commit; and the
workers' compile cache."""
