//! The documents say what the code does: the status table in docs/PROTOCOL.md is the one in
//! the SDK.

use chorus_sdk::StatusCode;

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

/// The table of reply performatives in docs/PROTOCOL.md section 7.1 is what
/// `Envelope::reply` does, and names every status code once.
#[test]
fn protocol_reply_performatives_match_the_sdk() {
    use chorus_sdk::{Envelope, Kind, Performative};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/PROTOCOL.md");
    let doc = std::fs::read_to_string(path).expect("docs/PROTOCOL.md");
    let start = doc
        .find("<!-- reply-performatives -->")
        .expect("reply performatives marker");
    let rows: Vec<(Vec<u16>, String)> = doc[start..]
        .lines()
        .skip(1)
        .map(str::trim)
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            let codes = cells[0]
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|t| t.parse().ok())
                .collect();
            (codes, cells[1].trim_matches('`').to_owned())
        })
        .collect();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let mut named: Vec<u16> = rows.iter().flat_map(|(c, _)| c.clone()).collect();
    named.sort_unstable();
    let mut all: Vec<u16> = StatusCode::ALL.iter().map(|c| c.0).collect();
    all.sort_unstable();
    assert_eq!(named, all, "every code, once");
    let request = Envelope::new(Kind::Request, Performative::Request, "caller");
    for (codes, performative) in &rows {
        for code in codes.iter().copied().chain([5999]) {
            let reply = request.reply("callee", StatusCode(code));
            if code == 5999 && performative != "failure" {
                continue;
            }
            assert_eq!(reply.performative.as_str(), performative, "{code}");
        }
    }
}

/// The table of task moves in docs/PROTOCOL.md section 7.4 is the SDK's: every move it lists
/// is legal, and every move it does not list is refused.
#[test]
fn protocol_task_transitions_match_the_sdk() {
    use chorus_sdk::TaskState;
    use chorus_sdk::task::transition;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/PROTOCOL.md");
    let doc = std::fs::read_to_string(path).expect("docs/PROTOCOL.md");
    let start = doc
        .find("<!-- task-transitions")
        .expect("task transitions marker");
    let names = |cell: &str| -> Vec<String> {
        cell.split(',')
            .filter_map(|t| {
                let t = t.trim();
                (t.starts_with('`')).then(|| t.split('`').nth(1).unwrap_or_default().to_owned())
            })
            .collect()
    };
    let mut legal: Vec<(Option<TaskState>, TaskState)> = Vec::new();
    let rows: Vec<&str> = doc[start..]
        .lines()
        .skip(1)
        .map(str::trim)
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .collect();
    assert_eq!(rows.len(), 6, "{rows:?}");
    for row in rows {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        let from: Vec<Option<TaskState>> = if cells[0] == "(none)" {
            vec![None]
        } else {
            names(cells[0])
                .iter()
                .map(|n| Some(n.parse().expect("infallible")))
                .collect()
        };
        for f in from {
            for to in names(cells[1]) {
                legal.push((f, to.parse().expect("infallible")));
            }
        }
    }
    let task_states = [
        TaskState::Submitted,
        TaskState::Accepted,
        TaskState::Working,
        TaskState::InputRequired,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Cancelled,
        TaskState::Rejected,
        TaskState::Expired,
    ];
    for from in task_states.iter().copied().map(Some).chain([None]) {
        for to in task_states {
            assert_eq!(
                transition(from, to).is_ok(),
                legal.contains(&(from, to)),
                "{from:?} -> {to}"
            );
        }
    }
}

/// docs/SEEDS.md: the summary's counts are those of its tables, and every test a row names
/// (`e2e/file.rs::function`, `py/file.py::function`, `cli/file.rs::function`, or a path in
/// full) exists.
#[test]
fn the_seeds_table_counts_its_rows_and_names_tests_that_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/SEEDS.md")).expect("docs/SEEDS.md");
    let seeds = ["IAC", "AIXP", "002", "IACP", "Agentify"];
    let cells = |line: &str| -> Vec<String> {
        line.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_owned())
            .collect()
    };
    // Counted per seed: rows, met, does not apply, open.
    let mut counted = std::collections::BTreeMap::<&str, [usize; 4]>::new();
    let mut named = Vec::new();
    for line in doc.lines().filter(|l| l.starts_with("| ")) {
        let row = cells(line);
        let Some(seed) = seeds.iter().find(|s| **s == row[0]) else {
            continue;
        };
        if row.len() != 4 {
            continue; // the summary's rows
        }
        let met = &row[3];
        let class = if met.starts_with("open") {
            3
        } else if met.starts_with("does not apply") {
            2
        } else {
            1
        };
        let c = counted.entry(seed).or_default();
        c[0] += 1;
        c[class] += 1;
        for word in met.split(|c: char| c.is_whitespace() || ";,()`".contains(c)) {
            if let Some((file, function)) = word.split_once("::")
                && (file.ends_with(".rs") || file.ends_with(".py"))
            {
                named.push((file.to_owned(), function.trim_end_matches('.').to_owned()));
            }
        }
    }
    let summary = doc.find("## Summary").expect("the summary");
    let mut total = [0usize; 4];
    for line in doc[summary..].lines().filter(|l| l.starts_with("| ")) {
        let row = cells(line);
        let Ok(numbers) = row[1..]
            .iter()
            .map(|n| n.parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
        else {
            continue;
        };
        let expected = if row[0] == "all" {
            total
        } else {
            let c = counted[row[0].as_str()];
            for (t, n) in total.iter_mut().zip(c) {
                *t += n;
            }
            c
        };
        assert_eq!(numbers, expected, "the summary's row for {}", row[0]);
    }
    assert!(total[0] > 200, "the tables were read: {total:?}");
    // PROTOCOL.md's appendix repeats the summary: the same lines.
    let summary_lines = |text: &str, from: usize| -> Vec<String> {
        text[from..]
            .lines()
            .skip_while(|l| !l.starts_with("| seed | rows"))
            .take_while(|l| l.starts_with('|'))
            .map(str::to_owned)
            .collect()
    };
    let protocol =
        std::fs::read_to_string(root.join("docs/PROTOCOL.md")).expect("docs/PROTOCOL.md");
    let appendix = protocol
        .find("<!-- seeds-summary")
        .expect("the seeds summary in PROTOCOL.md");
    assert_eq!(
        summary_lines(&protocol, appendix),
        summary_lines(&doc, summary),
        "PROTOCOL.md's appendix and SEEDS.md's summary differ"
    );
    let mut missing = Vec::new();
    for (file, function) in named {
        let path = match file.split_once('/') {
            _ if root.join(&file).is_file() => root.join(&file),
            Some(("e2e", rest)) => root.join("tests/tests/e2e").join(rest),
            Some(("py", rest)) => root.join("python/tests").join(rest),
            Some(("cli", rest)) => root.join("cli/tests").join(rest),
            _ => root.join(&file),
        };
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let defined = [
            format!("fn {function}("),
            format!("fn {function}<"),
            format!("def {function}("),
        ];
        if !defined.iter().any(|d| text.contains(d.as_str())) {
            missing.push(format!("{file}::{function}"));
        }
    }
    missing.dedup();
    assert!(
        missing.is_empty(),
        "docs/SEEDS.md names tests that are not there: {missing:#?}"
    );
}
