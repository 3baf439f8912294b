"""Curation's own pieces: the datatrove blocks the curate stage runs (`blocks`), and the index of what the pipeline
evaluates on, which decontamination removes (`decontamination`)."""
