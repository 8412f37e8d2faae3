"""The qrels-derived human grades, re-exported where the judge's calibration always found them.

Their one home is :mod:`services.providers.human` (the console shows them too)."""

from services.providers.human import (  # noqa: F401
    K,
    NDCG_CUTS,
    TIE_DECIMALS,
    HumanGrades,
    QrelsStore,
    grades_from_qrels,
    human_grades,
    ndcg_grade,
    ranked_doc_ids,
    split_query_id,
    tiers_by_value,
)
