from django.contrib import admin
from django.urls import include, path

from config import openapi
from inference.api import operations
from inference.reporting import views as reporting

# The node has no site of its own to view (its root answers API clients): no "View site" link in the admin.
admin.site.site_url = None

urlpatterns = [
    # Before the admin's own URLs, which would otherwise answer 404 for this path.
    path("admin/usage/report/", admin.site.admin_view(reporting.usage_report), name="usage-report"),
    path("admin/", admin.site.urls),
    path("v1/infer/", include("inference.urls")),
    path("v1/openapi.json", openapi.openapi, name="openapi"),
    path("v1/", include("agents.urls")),
    path("metrics", operations.metrics, name="metrics"),
    path("health", operations.health, name="health"),
]

handler400 = "inference.api.errors.handler400"
handler404 = "inference.api.errors.handler404"
handler500 = "inference.api.errors.handler500"
