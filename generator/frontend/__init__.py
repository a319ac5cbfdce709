"""Stages load and build: the DSL a model file is written in, the loader that
runs the file, and the builder that turns the DSL calls into an ir.Graph."""
