//! `multipart/form-data` (RFC 7578) over a body already read within its
//! size limit: the parts' names, file names and bytes. Only what
//! `POST /v1/files` needs; anything malformed is an error naming why, never
//! a guess.

/// One part of the form.
#[derive(Debug, PartialEq, Eq)]
pub struct Part<'a> {
    /// `name` of its Content-Disposition.
    pub name: String,
    /// `filename`, when it is a file.
    pub filename: Option<String>,
    /// Its bytes.
    pub data: &'a [u8],
}

/// Most parts read from one form: the upload has two.
const MAX_PARTS: usize = 16;
/// Longest head of one part.
const MAX_PART_HEAD: usize = 8 * 1024;

/// The boundary of a `multipart/form-data` Content-Type, if it is one.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut params = content_type.split(';');
    let essence = params.next()?.trim();
    if !essence.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.find_map(|p| {
        let (k, v) = p.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let v = v.trim().trim_matches('"');
        // RFC 2046: 1 to 70 characters.
        (!v.is_empty() && v.len() <= 70).then(|| v.to_string())
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let first = *needle.first()?;
    let mut i = from;
    while i + needle.len() <= hay.len() {
        let rel = hay[i..=hay.len() - needle.len()].iter().position(|&b| b == first)?;
        i += rel;
        if &hay[i..i + needle.len()] == needle {
            return Some(i);
        }
        i += 1;
    }
    None
}

/// A parameter of a Content-Disposition value (`name="purpose"`).
fn param(disposition: &str, key: &str) -> Option<String> {
    disposition.split(';').skip(1).find_map(|p| {
        let (k, v) = p.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case(key) {
            return None;
        }
        let v = v.trim();
        let v = v.strip_prefix('"').and_then(|s| s.strip_suffix('"')).unwrap_or(v);
        Some(v.replace("\\\"", "\""))
    })
}

/// The parts of `body`, delimited by `boundary`.
pub fn parse<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, String> {
    let open = format!("--{boundary}");
    let delim = format!("\r\n--{boundary}");
    let start = if body.starts_with(open.as_bytes()) {
        0
    } else {
        // A preamble before the first delimiter is allowed and ignored.
        find(body, delim.as_bytes(), 0).map(|p| p + 2).ok_or("no boundary in the body")?
    };
    let mut at = start + open.len();
    let mut parts = vec![];
    loop {
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            return Ok(parts);
        }
        if !rest.starts_with(b"\r\n") {
            return Err("a boundary is not followed by a line break".into());
        }
        if parts.len() == MAX_PARTS {
            return Err(format!("more than {MAX_PARTS} parts"));
        }
        let head_start = at + 2;
        let head_end = find(body, b"\r\n\r\n", head_start)
            .filter(|&e| e - head_start <= MAX_PART_HEAD)
            .ok_or("a part's headers do not end")?;
        let head = std::str::from_utf8(&body[head_start..head_end])
            .map_err(|_| "a part's headers are not UTF-8")?;
        let disposition = head
            .split("\r\n")
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim().eq_ignore_ascii_case("content-disposition").then(|| v.trim())
            })
            .ok_or("a part has no Content-Disposition")?;
        let name = param(disposition, "name").ok_or("a part has no name")?;
        let filename = param(disposition, "filename");
        let data_start = head_end + 4;
        let data_end =
            find(body, delim.as_bytes(), data_start).ok_or("the form has no closing boundary")?;
        parts.push(Part { name, filename, data: &body[data_start..data_end] });
        at = data_end + delim.len();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn form(b: &str, file: &[u8]) -> Vec<u8> {
        let mut v = format!(
            "--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{b}\r\n\
             Content-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .into_bytes();
        v.extend_from_slice(file);
        v.extend_from_slice(format!("\r\n--{b}--\r\n").as_bytes());
        v
    }

    #[test]
    fn reads_the_sdks_upload() {
        let ct = "multipart/form-data; boundary=abc123";
        let b = boundary(ct).unwrap();
        let body = form(&b, b"{\"a\":1}\n{\"b\":2}\n");
        let parts = parse(&body, &b).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!((parts[0].name.as_str(), parts[0].data), ("purpose", &b"batch"[..]));
        assert_eq!(parts[1].filename.as_deref(), Some("in.jsonl"));
        assert_eq!(parts[1].data, b"{\"a\":1}\n{\"b\":2}\n");
    }

    #[test]
    fn a_file_holding_boundary_lookalikes_is_kept_whole() {
        let b = "xyz";
        let data = b"--xyz is not a boundary without CRLF\r\n-xyz\r\n--xy\r\n";
        let body = form(b, data);
        assert_eq!(parse(&body, b).unwrap()[1].data, data);
    }

    #[test]
    fn malformed_forms_are_refused() {
        assert!(boundary("application/json").is_none());
        assert!(boundary("multipart/form-data").is_none(), "no boundary");
        assert!(boundary(&format!("multipart/form-data; boundary={}", "a".repeat(71))).is_none());
        let b = "q";
        let body = form(b, b"data");
        assert!(parse(&body[..body.len() - 8], b).is_err(), "no closing boundary");
        assert!(parse(b"no boundary here", b).is_err());
        let nameless = b"--q\r\nContent-Disposition: form-data\r\n\r\nx\r\n--q--";
        assert!(parse(nameless, b).unwrap_err().contains("no name"));
        let many: String = (0..20)
            .map(|i| format!("--q\r\nContent-Disposition: form-data; name=\"p{i}\"\r\n\r\nx\r\n"))
            .collect::<String>()
            + "--q--";
        assert!(parse(many.as_bytes(), b).unwrap_err().contains("parts"));
    }
}
