"""What the models read: documents and chat messages turned into the target's and the drafter's prompts.

``prompts`` (one template for both views, middle truncation), ``conversation`` (chat messages and documents,
retrieval over a long history), ``demo_document`` (the built-in document and its questions) and ``textio``
(reading a user's text files). Torch-free; retrieval loads its models only when a prompt needs them.
"""
