"""URL routes: admin, REST API (token or session auth), Prometheus metrics."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from devices.api import DeviceGroupViewSet, DeviceViewSet
from iotqueue.auth_token import TokenObtainView
from iotqueue.views import metrics_view
from jobs.admin.dashboard import dashboard_urls
from jobs.api import (
    CanvasCancelView,
    ConcurrencyLimitViewSet,
    DeviceLockReleaseView,
    DeviceLockView,
    MaintenanceWindowViewSet,
    RunViewSet,
    TemplateViewSet,
)
from triggers.api import ScheduleViewSet, TriggerRuleViewSet
from webhooks.api import WebhookViewSet

router = DefaultRouter()
router.register("runs", RunViewSet, basename="run")
router.register("templates", TemplateViewSet, basename="template")
router.register("windows", MaintenanceWindowViewSet, basename="window")
router.register("devices", DeviceViewSet, basename="device")
router.register("groups", DeviceGroupViewSet, basename="group")
router.register("schedules", ScheduleViewSet, basename="schedule")
router.register("trigger-rules", TriggerRuleViewSet, basename="trigger-rule")
router.register("webhooks", WebhookViewSet, basename="webhook")
router.register("limits", ConcurrencyLimitViewSet, basename="limit")

urlpatterns = [
    # The site's front page is the admin (the operator console). Temporary: the root may
    # serve something else one day, and browsers must not remember this answer for good.
    path("", RedirectView.as_view(pattern_name="admin:index", permanent=False), name="root"),
    # The admin's first page is the dashboard (the admin's index plus its panels), and its fragment.
    *dashboard_urls(),
    path("admin/", admin.site.urls),
    # set_language: the admin header's language switcher posts here (a cookie keeps the choice).
    path("i18n/", include("django.conf.urls.i18n")),
    path("api/devices/<str:name>/lock/", DeviceLockView.as_view(), name="device-lock"),
    path("api/devices/<str:name>/lock/release/", DeviceLockReleaseView.as_view(), name="device-lock-release"),
    path("api/canvases/<str:root_id>/cancel/", CanvasCancelView.as_view(), name="canvas-cancel"),
    path("api/", include(router.urls)),
    path("api/token/", TokenObtainView.as_view(), name="api-token"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    # Our template: drf-spectacular's, without the Google Fonts it links (nothing from another host).
    path(
        "api/docs/redoc/",
        SpectacularRedocView.as_view(url_name="api-schema", template_name="iotqueue/redoc.html"),
        name="api-redoc",
    ),
    path("metrics", metrics_view, name="metrics"),
]

# JSON, not HTML, for a URL under /api/ that no route matches (iotqueue/error_pages.py).
handler400 = "iotqueue.error_pages.bad_request"
handler404 = "iotqueue.error_pages.not_found"
