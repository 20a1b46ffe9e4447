"""The learning science: the corpus, training (single and distributed), checkpoints, evaluation, selection and
statistics."""
