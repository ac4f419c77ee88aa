"""The admin usage report's filters."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date, timedelta
from typing import Any

from django import forms
from django.db.models import Max

from inference.models import CatalogEntry, UsageDailyRollup, UsageRecord
from inference.usage.reports import MAX_REPORT_DAYS, UsageFilter, day_start, utc_today
from orgs.models import APIKey, Organization

DEFAULT_DAYS = 14


class KeyChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj: APIKey) -> str:
        return f"{obj.organization.slug} / {obj}"


class UsageReportForm(forms.Form):
    """Days are UTC days; ``end`` is the last day shown (inclusive, as a date picker reads)."""

    start = forms.DateField(label="From", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(label="Through", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    organization = forms.ModelChoiceField(
        Organization.objects.all(), required=False, empty_label="All organizations", to_field_name="slug"
    )
    api_key = KeyChoiceField(
        APIKey.objects.select_related("organization").order_by("organization__slug", "name"),
        required=False,
        empty_label="All keys",
        label="Key",
    )
    model = forms.ChoiceField(required=False)

    def __init__(self, data: Mapping[str, str] | None = None) -> None:
        today = utc_today()
        defaults = {"start": (today - timedelta(days=DEFAULT_DAYS - 1)).isoformat(), "end": today.isoformat()}
        super().__init__({**defaults, **{k: v for k, v in (data or {}).items() if v}})
        known = set(CatalogEntry.objects.values_list("public_id", flat=True))
        rollups = UsageDailyRollup.objects.order_by()
        known |= set(rollups.values_list("model", flat=True).distinct())
        # And the models of the days not rolled up yet (today, and the days before the next rollup runs).
        last_rolled = rollups.aggregate(last=Max("day"))["last"]
        unrolled = UsageRecord.objects.order_by()
        if last_rolled is not None:
            unrolled = unrolled.filter(created__gte=day_start(last_rolled + timedelta(days=1)))
        known |= set(unrolled.values_list("model", flat=True).distinct())
        self.fields["model"].choices = [("", "All models"), *((m, m) for m in sorted(known))]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        start: date | None = data.get("start")
        end: date | None = data.get("end")
        if start is None or end is None:
            return data  # the field's own error says why
        if end == date.max:
            # The report runs up to the day after 'Through', which the calendar does not have.
            self.add_error("end", f"Choose a day before {date.max.isoformat()}.")
            return data
        if start > end:
            raise forms.ValidationError("'From' must not be after 'Through'.")
        if (end - start).days >= MAX_REPORT_DAYS:
            raise forms.ValidationError(f"Choose at most {MAX_REPORT_DAYS} days.")
        key, organization = data.get("api_key"), data.get("organization")
        if key is not None and organization is not None and key.organization_id != organization.pk:
            self.add_error("api_key", "This key belongs to another organization.")
        return data

    def usage_filter(self) -> UsageFilter:
        data = self.cleaned_data
        return UsageFilter(
            start=data["start"],
            end=data["end"] + timedelta(days=1),
            organization_id=data["organization"].pk if data.get("organization") else None,
            api_key_id=data["api_key"].pk if data.get("api_key") else None,
            model=data.get("model") or None,
        )
