"""A template's versions in the admin: its history, one version, the diff of two. Read-only;
a version is started from the template's *Run now* form (`?version=N`)."""

from __future__ import annotations

from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.template.response import TemplateResponse
from django.urls import path
from django.utils.translation import gettext as _

from ..models import JobTemplate, TemplateVersion
from ..services import plan_step_target
from ..versions import snapshot_text, version_snapshot, versions_diff


class TemplateVersionsAdminMixin:
    """Pages under a template's change page: versions/, versions/<n>/, versions/diff/?a=&b=.

    Mixed into the template's ModelAdmin; who may view the template may view its versions.
    """

    def version_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/versions/", view(self.versions_view), name="jobs_jobtemplate_versions"),
            path(
                "<path:object_id>/versions/diff/",
                view(self.versions_diff_view),
                name="jobs_jobtemplate_versions_diff",
            ),
            path(
                "<path:object_id>/versions/<int:number>/",
                view(self.version_view),
                name="jobs_jobtemplate_version",
            ),
        ]

    def versions_view(self, request, object_id):
        """The template's history: every version, newest first, with its author and time."""
        template = self._versions_template(request, object_id)
        versions = list(template.versions.select_related("author").order_by("-number"))
        for version, older in zip(versions, [*versions[1:], None], strict=False):
            version.previous_number = older.number if older else None
        return self._versions_render(
            request,
            template,
            "versions.html",
            title=_("Versions of %(template)s") % {"template": template.name},
            versions=versions,
        )

    def version_view(self, request, object_id, number: int):
        """One version: what a run of it executes, and *Run this version*."""
        template = self._versions_template(request, object_id)
        version = self._version(template, number)
        return self._versions_render(
            request,
            template,
            "version.html",
            title=_("%(template)s, version %(number)d")
            % {"template": template.name, "number": version.number},
            version=version,
            steps=version_steps(version),
            snapshot=snapshot_text(version_snapshot(version)),
            latest=template.versions.order_by("-number").values_list("number", flat=True).first(),
            can_run=request.user.has_perm("jobs.add_jobrun"),
        )

    def versions_diff_view(self, request, object_id):
        """The unified diff from version ?a= to version ?b= (default: the two newest)."""
        template = self._versions_template(request, object_id)
        numbers = list(template.versions.order_by("-number").values_list("number", flat=True))
        if not numbers:
            raise Http404(f"{template.name} has no versions")
        new = version_number_param(request, "b", numbers[0])
        old = version_number_param(request, "a", numbers[1] if len(numbers) > 1 else numbers[0])
        old_version, new_version = self._version(template, old), self._version(template, new)
        return self._versions_render(
            request,
            template,
            "versions_diff.html",
            title=_("%(template)s: version %(old)d → %(new)d")
            % {"template": template.name, "old": old, "new": new},
            old=old_version,
            new=new_version,
            numbers=numbers,
            diff=versions_diff(old_version, new_version),
        )

    def _versions_template(self, request, object_id) -> JobTemplate:
        template = self.get_object(request, unquote(object_id))
        if template is None:
            raise Http404(f"no template with id {object_id!r}")
        if not self.has_view_permission(request, template):
            raise PermissionDenied
        return template

    @staticmethod
    def _version(template: JobTemplate, number: int) -> TemplateVersion:
        version = template.versions.select_related("author", "template").filter(number=number).first()
        if version is None:
            raise Http404(f"{template.name} has no version {number}")
        return version

    def _versions_render(self, request, template: JobTemplate, page: str, **context) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "original": template,
            "media": self.media,
            **context,
        }
        return TemplateResponse(request, f"admin/jobs/jobtemplate/{page}", context)


def version_steps(version: TemplateVersion) -> list[dict]:
    """A version's steps as the admin's step tables show them (target named for people)."""
    return [{**spec, "target_label": plan_step_target(spec)} for spec in version.steps]


def version_number_param(request, name: str, default: int | None = None) -> int | None:
    """A version number from the query string (`default` when absent); 404 when malformed."""
    value = request.GET.get(name, "")
    if not value:
        return default
    if not value.isdigit():
        raise Http404(f"{name} must be a version number")
    return int(value)
