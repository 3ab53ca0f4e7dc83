"""`POST /api/token/`: exchange a username and password for an API token, rate-limited."""

from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.settings import api_settings

from .throttling import TokenObtainThrottle


class TokenObtainView(ObtainAuthToken):
    """DRF's token view (which has no throttle of its own), limited per client address.

    Failed logins also count toward the lockouts (django-axes: the username from that address,
    and the address across usernames), as in the admin. The token is returned as DRF stores
    it; the admin never shows it (iotqueue/admin.py).
    """

    throttle_classes = [TokenObtainThrottle]
    # The project's parsers (iotqueue/api.py), not the plain ones DRF's view names: this
    # endpoint is anonymous, so its bodies are bounded like every other.
    parser_classes = api_settings.DEFAULT_PARSER_CLASSES
