"""URL routes: admin, REST API (token or session auth)."""

from django.contrib import admin
from django.urls import include, path
from rest_framework.authtoken.views import obtain_auth_token
from rest_framework.routers import DefaultRouter

from jobs.api import RunViewSet

router = DefaultRouter()
router.register("runs", RunViewSet, basename="run")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/", include(router.urls)),
    path("api/token/", obtain_auth_token, name="api-token"),
]
