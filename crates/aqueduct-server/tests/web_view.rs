//! The live web view on the metrics endpoint: `GET /` and `/web/` serve the page (told the
//! broker's QUIC port and WebTransport path), `/web/app.js` its script, and `/web/aqueduct/*.js`
//! the JavaScript client of `clients/js` byte for byte; every module any of them imports is
//! served; nothing is loaded from elsewhere. (The page in a real browser:
//! crates/aqueduct-cli/tests/browser.rs.)

mod common;

use std::net::SocketAddr;

use common::*;

/// One GET: (status, lower-cased headers, body).
async fn fetch(addr: SocketAddr, path: &str) -> (u16, Vec<(String, String)>, String) {
    let (status, raw) =
        http_response(addr, &format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")).await;
    let (head, body) = raw.split_once("\r\n\r\n").expect("a head");
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, body.to_string())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name} header in {headers:?}"))
}

/// The module paths a script imports (`import … from '…'`, `export * from '…'`).
fn imports(js: &str) -> Vec<String> {
    js.lines()
        .filter(|l| {
            let l = l.trim_start();
            l.starts_with("import ") || l.starts_with("export ") || l.starts_with("} from ")
        })
        .filter_map(|l| l.split(" from '").nth(1))
        .filter_map(|rest| rest.split('\'').next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_view_and_the_js_client_are_served() {
    let b = TestBroker::start().await;
    let js_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../clients/js");
    for path in ["/", "/web/"] {
        let (status, headers, page) = fetch(b.metrics_addr, path).await;
        assert_eq!(status, 200, "{path}: {page}");
        assert_eq!(header(&headers, "content-type"), "text/html; charset=utf-8");
        let csp = header(&headers, "content-security-policy");
        assert!(csp.contains("script-src 'self'"), "{csp}");
        assert!(
            page.contains(&format!(
                r#"<meta name="aqueduct-wt-port" content="{}">"#,
                b.addr.port()
            )),
            "{path}: the QUIC port is not in the page"
        );
        assert!(page.contains(r#"<meta name="aqueduct-wt-path" content="/aqueduct/wt">"#));
        assert!(page.contains(r#"<script type="module" src="/web/app.js"></script>"#));
        // Self-contained: no script, style or image from another host.
        for outside in ["http://", "https://", "//cdn"] {
            let found = page
                .match_indices(outside)
                .map(|(i, _)| &page[i.saturating_sub(12)..i])
                .find(|before| before.contains("src=") || before.contains("href="));
            assert!(found.is_none(), "{path} loads {outside}…");
        }
        for id in [
            "status",
            "filter",
            "subscribe-button",
            "pub-topic",
            "pub-body",
            "pub-priority",
            "publish-button",
            "rate",
            "rows",
        ] {
            assert!(page.contains(&format!(r#"id="{id}""#)), "{path}: no #{id}");
        }
    }
    let (status, headers, _) = fetch(b.metrics_addr, "/web").await;
    assert_eq!(status, 308);
    assert_eq!(header(&headers, "location"), "/web/");

    // The page's script and everything it imports, transitively.
    let mut todo = vec!["/web/app.js".to_string()];
    let mut seen = Vec::new();
    while let Some(path) = todo.pop() {
        if seen.contains(&path) {
            continue;
        }
        let (status, headers, js) = fetch(b.metrics_addr, &path).await;
        assert_eq!(status, 200, "{path}: {js}");
        assert_eq!(
            header(&headers, "content-type"),
            "text/javascript; charset=utf-8",
            "{path}"
        );
        let dir = &path[..path.rfind('/').expect("a slash") + 1];
        for import in imports(&js) {
            let resolved = match import.strip_prefix("./") {
                Some(rel) => format!("{dir}{rel}"),
                None => import.clone(),
            };
            assert!(resolved.starts_with("/web/"), "{path} imports {import}");
            todo.push(resolved);
        }
        seen.push(path);
    }
    for module in ["index.js", "codec.js", "client.js"] {
        let path = format!("/web/aqueduct/{module}");
        assert!(seen.contains(&path), "{path} is not imported: {seen:?}");
        let (_, _, served) = fetch(b.metrics_addr, &path).await;
        let file = std::fs::read_to_string(format!("{js_dir}/{module}")).expect("clients/js");
        assert!(served == file, "{path} is not clients/js/{module} as it is");
    }
    let (status, _, _) = fetch(b.metrics_addr, "/web/aqueduct/nope.js").await;
    assert_eq!(status, 404);
    let (status, _, body) = fetch(b.metrics_addr, "/nope").await;
    assert_eq!(status, 404);
    assert!(body.contains("the live web view"), "{body}");
}
