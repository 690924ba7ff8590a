"""The stages of dvc.yaml, one package each: a thin click command that calls one library function."""
