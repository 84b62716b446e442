"""The ledger prices cached input and reasoning tokens apart.

* ``ledger.cached_tokens`` and ``ledger.reasoning_tokens``: the parts of a call's
  ``prompt_tokens`` the provider served from its prompt cache
  (``prompt_tokens_details.cached_tokens``) and of its ``completion_tokens`` spent on
  reasoning (``completion_tokens_details.reasoning_tokens``). Both are parts of the
  totals, never added to them, as the OpenAI API reports them.
* ``prices.cached_prompt_usd_per_mtok`` and ``prices.reasoning_usd_per_mtok``: their
  prices; NULL means the model's prompt or completion price applies to them too.
* ``ck_prices_not_negative``: no price below 0, however it is written.

Backward compatible: new columns with defaults. A worker of the previous release
writes rows without the new counts (0: every token at the full price, as it priced
them) and reads prices by named columns.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

MONEY = sa.Numeric(18, 8)
# koda prices set refuses a negative price; the table refuses one written any other way.
PRICES_NOT_NEGATIVE = (
    "prompt_usd_per_mtok >= 0 AND completion_usd_per_mtok >= 0"
    " AND coalesce(cached_prompt_usd_per_mtok, 0) >= 0"
    " AND coalesce(reasoning_usd_per_mtok, 0) >= 0"
)


def upgrade() -> None:
    zero = sa.text("0")
    op.add_column(
        "ledger", sa.Column("cached_tokens", sa.Integer, nullable=False, server_default=zero)
    )
    op.add_column(
        "ledger", sa.Column("reasoning_tokens", sa.Integer, nullable=False, server_default=zero)
    )
    op.create_check_constraint(
        "ck_ledger_token_parts",
        "ledger",
        "cached_tokens BETWEEN 0 AND prompt_tokens"
        " AND reasoning_tokens BETWEEN 0 AND completion_tokens",
    )
    op.add_column("prices", sa.Column("cached_prompt_usd_per_mtok", MONEY, nullable=True))
    op.add_column("prices", sa.Column("reasoning_usd_per_mtok", MONEY, nullable=True))
    op.create_check_constraint("ck_prices_not_negative", "prices", PRICES_NOT_NEGATIVE)


def downgrade() -> None:
    op.drop_constraint("ck_prices_not_negative", "prices", type_="check")
    op.drop_column("prices", "reasoning_usd_per_mtok")
    op.drop_column("prices", "cached_prompt_usd_per_mtok")
    op.drop_constraint("ck_ledger_token_parts", "ledger", type_="check")
    op.drop_column("ledger", "reasoning_tokens")
    op.drop_column("ledger", "cached_tokens")
