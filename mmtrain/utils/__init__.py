"""Small shared helpers (atomic files, logging) used by both mmtrain and dataprep."""
