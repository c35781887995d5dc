//! Which connection gives way to a new one when a listener's slots are all taken (the admin
//! API's TLS handshakes, the metrics endpoint's connections): one from the address that holds
//! the most, the oldest of those. So connections that hold a slot and do nothing, from however
//! many addresses, cannot keep a new one out, and one address's cannot push out another's.

use std::collections::HashMap;
use std::net::IpAddr;

/// Where a connection comes from, for limits per address: its IPv4 address, or its IPv6
/// address's /64 (one host may use any address of its /64).
pub(crate) fn address_group(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                u128::from(v6) & !((1u128 << 64) - 1),
            )),
        },
        v4 => v4,
    }
}

/// The indices of `groups` (each slot's address group, oldest slot first) that `eligible`
/// allows to give way, best first: the group holding the most slots first, the oldest first
/// among equals.
pub(crate) fn eviction_order(groups: &[IpAddr], eligible: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut held: HashMap<IpAddr, usize> = HashMap::new();
    for g in groups {
        *held.entry(*g).or_default() += 1;
    }
    let mut order: Vec<usize> = (0..groups.len()).filter(|&i| eligible(i)).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(held[&groups[i]]), i));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// IPv6 addresses of one /64 are one group (a host may use any of them); IPv4 addresses,
    /// and IPv4 mapped into IPv6, are each their own.
    #[test]
    fn connections_are_grouped_per_ipv4_address_and_ipv6_64() {
        let g = |s: &str| address_group(s.parse().expect("ip"));
        assert_eq!(g("2001:db8:1:2::5"), g("2001:db8:1:2:ffff::1"));
        assert_ne!(g("2001:db8:1:2::5"), g("2001:db8:1:3::5"));
        assert_eq!(g("10.0.0.1"), g("::ffff:10.0.0.1"));
        assert_ne!(g("10.0.0.1"), g("10.0.0.2"));
    }

    /// The busiest group's slots first, oldest first; what is not eligible is left out.
    #[test]
    fn the_busiest_group_gives_way_first() {
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let groups = [a, b, b, a, b];
        assert_eq!(eviction_order(&groups, |_| true), vec![1, 2, 4, 0, 3]);
        assert_eq!(eviction_order(&groups, |i| i != 1), vec![2, 4, 0, 3]);
    }
}
