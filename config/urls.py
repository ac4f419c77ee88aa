from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/infer/", include("inference.urls")),
]

handler400 = "inference.errors.handler400"
handler404 = "inference.errors.handler404"
handler500 = "inference.errors.handler500"
