"""The Beam stages, in the job's order: read, reuse, tokenize, bucket (batch), encode, write, commit."""
