"""The prep stage: raw text and media into training shards (`mmtrain-prep`, `python -m dataprep`)."""
