"""Commands beside the job: the HTML report, bucket advice, config validation."""
