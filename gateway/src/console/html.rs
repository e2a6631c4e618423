//! HTML: the one escaping function every value goes through, the shared layout with its nav
//! bar, error pages, and the security headers every answer carries.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The Content-Security-Policy of every answer: script and style only from the console's own
/// files, no inline script, no framing.
pub(crate) const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'";

/// `text` safe to put in HTML text or a quoted attribute value: `& < > " '` escaped.
pub(crate) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one component of a URL (a path segment or a query value), percent-encoded; the
/// result still goes through [`esc`] when put in HTML.
pub(crate) fn url_part(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// What the layout needs to know of the caller.
pub(crate) struct Chrome<'a> {
    /// The identity the caller is signed in as.
    pub(crate) identity: &'a str,
    /// The session's CSRF token, when the caller came with a session cookie.
    pub(crate) csrf: Option<&'a str>,
}

/// The hidden CSRF input every form carries (empty for a caller without a session).
pub(crate) fn csrf_input(csrf: Option<&str>) -> String {
    csrf.map(|t| format!(r#"<input type="hidden" name="csrf" value="{}">"#, esc(t)))
        .unwrap_or_default()
}

/// A whole page: the layout around `body` (already HTML, its values escaped).
pub(crate) fn layout(title: &str, chrome: Option<&Chrome<'_>>, body: &str) -> String {
    let nav = match chrome {
        Some(c) => format!(
            r#"<nav id="nav"><a href="/">Overview</a> <a href="/agents">Agents</a> <a href="/tasks">Tasks</a> <a href="/dlq">Dead letters</a> <a href="/tap">Live traffic</a><span class="who">signed in as <b id="identity">{}</b> <form method="post" action="/logout" class="inline">{}<button id="logout" type="submit">Sign out</button></form></span></nav>"#,
            esc(c.identity),
            csrf_input(c.csrf)
        ),
        None => r#"<nav id="nav"><b>Chorus console</b></nav>"#.to_owned(),
    };
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{} · Chorus console</title>\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <link rel=\"icon\" href=\"/favicon.ico\"><link rel=\"stylesheet\" href=\"/static/console.css\">\
         <script src=\"/static/console.js\" defer></script></head><body>{nav}<main>\
         <h1>{}</h1>{body}</main></body></html>\n",
        esc(title),
        esc(title)
    )
}

/// An HTML answer with `status`.
pub(crate) fn html(status: StatusCode, page: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        page,
    )
        .into_response()
}

/// A page that says what went wrong, with `status` (400, 403, 404, 503...).
pub(crate) fn error(status: StatusCode, chrome: Option<&Chrome<'_>>, message: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    let body = format!(
        r#"<p id="error" class="error">{}</p><p><a href="/">Back to the overview</a></p>"#,
        esc(message)
    );
    html(status, layout(title, chrome, &body))
}

/// A 303 to `location` (a path of the console's own).
pub(crate) fn see_other(location: &str) -> Response {
    let mut r = StatusCode::SEE_OTHER.into_response();
    if let Ok(v) = HeaderValue::from_str(location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

/// Adds the security headers to every answer: the CSP, no sniffing, the referrer kept to this
/// origin, no framing, and nothing stored by caches.
pub(crate) async fn secure(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

/// `ms` since the epoch as a UTC date and time to the second.
pub(crate) fn utc(ms: u64) -> String {
    let format = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second]");
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&format).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// How long ago `ms` was, in its largest two units (`3m12s`, `2d4h`).
pub(crate) fn age(now: u64, ms: u64) -> String {
    let s = now.saturating_sub(ms) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `value` as indented JSON in a `<pre>`, escaped.
pub(crate) fn json_pre(id: &str, value: &serde_json::Value) -> String {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    format!(r#"<pre id="{}" class="json">{}</pre>"#, esc(id), esc(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_markup_character_is_escaped() {
        assert_eq!(
            esc(r#"<script>alert("x&y")</script>'"#),
            "&lt;script&gt;alert(&quot;x&amp;y&quot;)&lt;/script&gt;&#39;"
        );
        assert_eq!(esc("plain-id_1.2"), "plain-id_1.2");
        let page = layout(
            "<b>",
            Some(&Chrome {
                identity: "<img src=x>",
                csrf: Some("\"tok"),
            }),
            "",
        );
        assert!(!page.contains("<img src=x>") && !page.contains("<title><b>"));
        assert!(page.contains("&lt;img src=x&gt;") && page.contains("value=\"&quot;tok\""));
    }

    #[test]
    fn url_parts_are_percent_encoded() {
        assert_eq!(url_part("a b/<c>"), "a%20b%2F%3Cc%3E");
        assert_eq!(url_part("calc-1.x"), "calc-1.x");
    }
}
