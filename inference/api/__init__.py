"""HTTP: the node API's views and their base, the body parser, the middleware that wraps every API request,
the one error renderer, the WebSocket refusal, and the ``/metrics`` and ``/health`` endpoints.

Views validate with ``inference.openai``, call one workflow of ``inference.serving`` and render its result.
"""
