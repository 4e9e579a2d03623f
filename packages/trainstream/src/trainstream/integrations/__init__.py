"""Integrations with other libraries (Hugging Face: ``trainstream.integrations.huggingface``)."""

__all__: list[str] = []
