"""The seed model: verifying the pinned seed, building the tiny local seed, importing a seed into a bundle."""
