"""ninfer-example: the toy model family docs/plugins/tutorial.md builds, step by step."""
