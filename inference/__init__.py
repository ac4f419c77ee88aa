"""The node API: the model catalog, OpenAI-compatible endpoints, generation, usage.

One subpackage per layer, imports flowing one way: ``api`` (HTTP) → ``serving`` (request workflows) →
``engine`` (generation, with ``engine.runners``); ``openai`` (the wire format) is used by ``api`` and
``serving`` only; ``usage`` (records, reports, metrics, health) and ``reporting`` (the admin's usage
report) sit beside them. Django's and Celery's modules (models, admin, urls, tasks, migrations,
management commands, template tags) stay where Django and Celery look for them.
"""
