"""The notifiers: who gets paged when an alert fires or resolves, and the deliveries to them.

The engine hands each :class:`Notification` (an alert that starts firing, is re-sent,
or resolves) to a :class:`Dispatcher`, which routes it by its labels (:class:`Route`)
to the receivers of a YAML file (:func:`load_notify_config`, see docs/notifiers.md):
Alertmanager (API v2), PagerDuty Events v2, a Slack-compatible webhook, or a generic
webhook that gets Alertmanager's webhook JSON. Each receiver is a small adapter behind
one protocol, :class:`Notifier`.

``Dispatcher.submit()`` only appends to the receiver's bounded queue, from any thread:
a receiver that is down or slow never blocks the caller. Each receiver has its own
worker task; deliveries of different alerts run side by side (a hung request delays
nobody else), those of one alert in order (a resolve never overtakes its firing).
A failed attempt is retried with jittered exponential backoff while it can succeed
(timeouts, connection errors, 408, 429, 5xx), and every attempt is reported to
``on_attempt`` as an :class:`Attempt`.
"""

from .config import NotifyConfig, NotifyConfigError, Route, load_notify_config
from .dispatch import Attempt, Dispatcher
from .receivers import (
    AlertmanagerNotifier,
    DeliveryError,
    Notifier,
    PagerDutyNotifier,
    SlackNotifier,
    WebhookNotifier,
)

__all__ = [
    "AlertmanagerNotifier",
    "Attempt",
    "DeliveryError",
    "Dispatcher",
    "Notifier",
    "NotifyConfig",
    "NotifyConfigError",
    "PagerDutyNotifier",
    "Route",
    "SlackNotifier",
    "WebhookNotifier",
    "load_notify_config",
]
