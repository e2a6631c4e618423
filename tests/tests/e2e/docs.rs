//! The documents say what the code does: the status table in docs/PROTOCOL.md is the one in
//! the SDK.

use agent_sdk::StatusCode;

#[test]
fn protocol_status_table_matches_the_sdk() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/PROTOCOL.md");
    let doc = std::fs::read_to_string(path).expect("docs/PROTOCOL.md");
    let start = doc
        .find("<!-- status-table")
        .expect("status table start marker");
    let end = doc
        .find("<!-- /status-table -->")
        .expect("status table end marker");
    let rows: Vec<(u16, String, String)> = doc[start..end]
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line
                .trim()
                .trim_matches('|')
                .split('|')
                .map(str::trim)
                .collect();
            let code = cells.first()?.parse().ok()?;
            Some((
                code,
                cells[1].trim_matches('`').to_owned(),
                cells[2].to_owned(),
            ))
        })
        .collect();
    let expected: Vec<(u16, String, String)> = StatusCode::ALL
        .iter()
        .map(|c| {
            (
                c.0,
                c.label().to_owned(),
                c.description().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(rows, expected);
    // AIXP's own codes keep their numbers and meanings.
    assert_eq!(StatusCode::OK.0, 5002);
    assert_eq!(StatusCode::DATA_FORMAT.0, 5006);
    assert_eq!(StatusCode::UNEXPECTED_DISCONNECT.0, 5009);
}
