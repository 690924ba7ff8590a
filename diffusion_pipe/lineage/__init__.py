"""Lineage: where a LoRA came from. `record` builds and reads the records that train (checkpoints) and export
(every file it writes) stamp; `verify` checks one against a repository and the store; `diff` compares two;
`show` prints one readably; `cli` is `diffusion-pipe lineage`."""
