"""GPU kernel benchmarks (inference and training ops vs dense); see README.md."""
