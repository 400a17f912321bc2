"""The app's routes, one router per concern (as vLLM's ``entrypoints``): :mod:`.generation`
(``/v1/chat/completions``, ``/v1/completions``), :mod:`.tokens` (``/tokenize``, ``/detokenize``) and
:mod:`.admin` (``/health``, ``/metrics``, ``/v1/models``, ``/version``)."""
