//! An action form's fields, read: replay or purge, and of which dead
//! letters. Pure: nothing here touches the database.

use crate::admin::Selection;
use uuid::Uuid;

use super::super::form::Fields;
use super::super::layout::count;
use super::filter::{describe, filter_of};
use super::list::COUNT_CAP;

/// What an action form asks for: replay or purge, and of what.
pub(super) struct Request {
    pub(super) action: Action,
    pub(super) selection: Selection,
    /// How the selection reads, for the pages and the audit log.
    pub(super) described: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Replay,
    Purge,
}

impl Action {
    pub(super) fn name(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Purge => "purge",
        }
    }

    pub(super) fn verb(self) -> &'static str {
        match self {
            Action::Replay => "Replay",
            Action::Purge => "Purge",
        }
    }
}

pub(super) fn request_of(fields: &Fields) -> Result<Request, String> {
    let action = match fields.get("action") {
        Some("replay") => Action::Replay,
        Some("purge") => Action::Purge,
        _ => return Err("no action: replay or purge".to_owned()),
    };
    match fields.get("scope") {
        Some("ids") => {
            let mut ids = fields
                .all("ids")
                .filter(|v| !v.is_empty())
                .map(|v| Uuid::parse_str(v).map_err(|_| format!("not an event id: {v:?}")))
                .collect::<Result<Vec<_>, _>>()?;
            ids.sort_unstable();
            ids.dedup();
            if ids.is_empty() {
                return Err("select at least one dead letter first".to_owned());
            }
            let described = format!("{} selected dead letter(s)", ids.len());
            Ok(Request {
                action,
                selection: Selection::Ids(ids),
                described,
            })
        }
        Some("matching") => {
            let filter = filter_of(fields)?;
            let described = format!("dead letters matching {}", describe(&filter));
            Ok(Request {
                action,
                selection: Selection::Matching(filter),
                described,
            })
        }
        _ => Err("no scope: ids or matching".to_owned()),
    }
}

/// An action as its confirmation page sent it back: what, how many the
/// operator confirmed, and why.
pub(super) struct Confirmed {
    pub(super) request: Request,
    /// The confirmed count; `None` (`more`): every match up to the
    /// confirmed time.
    pub(super) expected: Option<u64>,
    /// Why, for the audit log.
    pub(super) reason: String,
}

impl Confirmed {
    /// The confirmed count as the result page and the audit log say it.
    pub(super) fn count(&self) -> String {
        self.expected.map_or_else(
            || format!("more than {}", count(COUNT_CAP)),
            |n| count(n as i64),
        )
    }
}

/// Step two's form, checked in the order its errors are reported.
pub(super) fn confirmed_of(fields: &Fields) -> Result<Confirmed, String> {
    let request = request_of(fields)?;
    let expected = expected_of(fields, &request.selection)?;
    if matches!(&request.selection, Selection::Matching(f) if f.until.is_none()) {
        return Err(
            "an action on a filter needs the time it was confirmed at (until): confirm it on its confirmation page"
                .to_owned(),
        );
    }
    let Some(reason) = fields.get("reason").map(str::to_owned) else {
        return Err("say why: the reason is recorded in the audit log".to_owned());
    };
    Ok(Confirmed {
        request,
        expected,
        reason,
    })
}

/// The confirmed count, or `more`: every match up to the confirmed time.
fn expected_of(fields: &Fields, selection: &Selection) -> Result<Option<u64>, String> {
    let unconfirmed =
        || "no confirmed count: confirm the action on its confirmation page".to_owned();
    match fields.get("expected") {
        Some("more") if matches!(selection, Selection::Matching(_)) => Ok(None),
        Some(v) => v.parse::<u64>().map(Some).map_err(|_| unconfirmed()),
        None => Err(unconfirmed()),
    }
}
