"""API permissions: Django's model permissions, reads included.

DRF's DjangoModelPermissions lets any authenticated user read; here reading a model
needs its `view_` permission too, so a user given no permissions sees nothing.
"""

from rest_framework.permissions import DjangoModelPermissions


class ModelPermissions(DjangoModelPermissions):
    perms_map = {
        **DjangoModelPermissions.perms_map,
        "GET": ["%(app_label)s.view_%(model_name)s"],
        "OPTIONS": ["%(app_label)s.view_%(model_name)s"],
        "HEAD": ["%(app_label)s.view_%(model_name)s"],
    }
