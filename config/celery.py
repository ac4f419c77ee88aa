"""The Celery app. Workers serve the queues of the models they host:
``celery -A config worker -Q model.b3os.smollm2-135m-instruct``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("b3os")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
